"""`emapg train`: the RL loop (trainer.py) and its parts — rollouts, log-prob passes, update, checkpoints, metrics."""
