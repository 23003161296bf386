"""The KL estimators' names and which direction each supports: plain data, importable without torch
or pydantic (the config models, the estimator registry and `emapg kl-check --help` all read it)."""

ESTIMATORS = ("exact", "k1", "k2", "k3", "k3pp", "k4", "k5", "topk", "topk_paper", "topk_mass", "truncated")

#: Estimators that only estimate one direction of the KL (the paper's Table 1).
REVERSE_ONLY = ("k1", "k2", "k3", "k3pp", "k4")
FORWARD_ONLY = ("k5",)
