"""Figures of training runs and evaluations (matplotlib, Agg backend), written as PNGs into `plots/`."""
