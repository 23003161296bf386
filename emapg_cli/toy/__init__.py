"""The toy task: two-digit addition and a tiny warm-started Llama, for RL you can watch on a CPU.

`emapg prepare --preset toy` calls `emapg_cli.toy.prepare.prepare_toy`; `emapg train --preset toy`
then trains on what it wrote (see presets/toy.yaml).
"""
