"""Tools for pass authors: the recorder (per-pass dumps, the report's pass table), `--verify`
(numeric check of every pass) and the test harness."""
