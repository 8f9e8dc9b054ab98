"""The error of a checkpoint batchgen does not run (its architecture, rope type, quantization...)."""


class UnsupportedModelError(ValueError):
    pass
