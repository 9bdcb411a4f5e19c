"""The operator's side: the HTTP listener and metrics, doctor, start-up checks of the machine,
and the process's garbage-collection pauses."""
