"""Small torch-free helpers the whole package shares: atomic and JSON file writes, progress
reporting of long jobs, plots of plans and runs, the output-path checks every entry point runs
before it works (``output_paths``) and the one-line warning of a flag that cannot apply
(``flag_warnings``)."""
