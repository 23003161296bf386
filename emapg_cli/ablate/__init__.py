"""`emapg ablate`: sweeps of `emapg train` runs (grids x variants x seeds), run locally or printed
for a cluster, then aggregated into results.csv, summary.md and plots."""
