"""hvd_gqsgd: Global-QSGD gradient compression for Horovod.

    from hvd_gqsgd import GlobalQSGD
    opt = hvd.DistributedOptimizer(opt, compression=GlobalQSGD(bits=8))

Importing this package imports neither torch, TensorFlow nor any ``horovod.<framework>``
module; the adapter for a framework loads when the first tensor of that framework arrives.
"""

from .compressor import GlobalQSGD
from .core import levels, min_bits
from .qsgd import QSGDAllgather

__all__ = ["GlobalQSGD", "QSGDAllgather", "levels", "min_bits"]
__version__ = "0.1.0"
