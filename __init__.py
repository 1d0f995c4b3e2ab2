"""moechat: a terminal chat that runs Mixture-of-Experts models larger than the GPU, fast."""

__version__ = "0.1.0"
