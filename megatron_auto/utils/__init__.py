"""Small torch-free helpers the whole package shares: atomic and JSON file writes, progress
reporting of long jobs, and plots of plans and runs."""
