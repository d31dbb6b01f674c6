"""A stub libnvidia-ml.so.1 built from nvml.h, for driving the real pynvml without a GPU."""
