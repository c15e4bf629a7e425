"""specchat: a local chat app that shows speculative decoding as it happens."""

import logging

__version__ = "0.1.0"


class _NoKernelsHubNote(logging.Filter):
    """bitsandbytes, imported on a CPU with AVX512-BF16, tries to fetch a CPU kernel from a model
    hub's `kernels` package and logs a warning when it cannot, which reads as an error at every
    start. specchat runs offline and uses bitsandbytes' own fused kernel there (`fast_cpu_nf4`),
    so that one message is dropped; every other bitsandbytes message stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoKernelsHubNote())
