"""kl-check: measure KL estimators and the stability of EMA-PG on small, exactly computable problems."""
