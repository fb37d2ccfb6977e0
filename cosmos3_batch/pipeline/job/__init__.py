"""The run from start to end: validate and plan every request (before any weight loads), load, drive this
rank's queue through the pass loop, end with one exit code and a summary, resume.
Imports passes/, finish/, kinds/."""
