"""Reports: tables and figures from finished runs (``kvbench report``)."""
