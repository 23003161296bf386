"""emapg: EMA Policy Gradient (arXiv 2602.04417) as a command-line toolkit."""

__version__ = "0.1.0"
