"""The README's Python example runs as written."""

import re
from pathlib import Path


def test_readme_python_example_runs():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"## Python API\n\n```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


def test_readme_quickstart_has_exactly_two_commands():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", quick, re.S)
    commands = [line for b in blocks for line in b.strip().splitlines()]
    assert commands == ['pip install . && lmcache-mp-server', 'pip install ".[test]" && pytest']
