"""Quality scoring shared by the benchmark harness and the quantisation report (torch-free)."""
