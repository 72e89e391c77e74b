"""ResidualKV (arXiv 2602.08005v2, first published as DeltaKV): each token's pre-RoPE K‖V is stored as
the mean of its k nearest reference tokens plus a learned, quantised residual code (§IV-A), restored by a
linear decoder only where sparse attention reads (§IV-B, §IV-C)."""
