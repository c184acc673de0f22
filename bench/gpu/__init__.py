"""The prepared GPU check (`bash bench/gpu_check.sh`): kernels, prefill, attention, serving, quantized base."""
