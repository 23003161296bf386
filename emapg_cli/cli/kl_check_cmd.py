"""`emapg kl-check` (placeholder until implemented)."""
