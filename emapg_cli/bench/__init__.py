"""Opt-in benchmarks (`emapg bench`): the fused output layer against its GEMM floor, the no-grad passes, one RL step."""
