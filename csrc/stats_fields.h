// Statistics structs list their fields once, as X(type, name) in a macro beside the struct:
// LMC_DECLARE_FIELD declares them (value-initialised), and a binding copies them into a Python
// dict with LMC_DICT_FIELD (a `py::dict d` and the struct `s` in scope), so no field is named twice.
#pragma once

#define LMC_DECLARE_FIELD(type, name) type name{};
#define LMC_DICT_FIELD(type, name) d[#name] = s.name;
