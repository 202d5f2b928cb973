"""What a person runs: `cli` (`monarch-run`, `monarch-plugin host|summary|timeline|doctor`), `doctor` (checks a
host before a run), `report` (a run's recoveries read back from its events) and `timeline` (the same drawn).
Nothing in the runtime imports these.
"""
