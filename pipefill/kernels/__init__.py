"""Native CPU kernels (built just-in-time on first use)."""
