"""Cost models: roofline (analytic.py), per-op profiling (profile.py), calibration."""
