"""hvd_gqsgd: Global-QSGD gradient compression for Horovod.

Entry points, all on the same core (:mod:`hvd_gqsgd.core`) and kernels::

    # Horovod, PyTorch or TensorFlow 2 (two_stage=True: reduce-scatter + requantize +
    # allgather, the default below 15 levels; rotation="hadamard": the default at 4 bits;
    # hierarchical=True: full precision inside nodes)
    from hvd_gqsgd import GlobalQSGD
    opt = hvd.DistributedOptimizer(opt, compression=GlobalQSGD(bits=8))

    # Keras 3 model.fit under Horovod
    from hvd_gqsgd.keras import DistributedOptimizer
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                 compression=GlobalQSGD(bits=8)), loss=...)

    # PyTorch DDP, no Horovod
    from hvd_gqsgd.ddp import GlobalQSGDState, global_qsgd_hook
    ddp_model.register_comm_hook(GlobalQSGDState(bits=8), global_qsgd_hook)

    # PyTorch FSDP2 (fully_shard), no Horovod: the gradient reduce-scatter
    import hvd_gqsgd.fsdp
    state = hvd_gqsgd.fsdp.register(model, bits=8)

    # local SGD with quantized syncs (Horovod + PyTorch)
    from hvd_gqsgd.torch import QPRSGD
    opt = QPRSGD(torch.optim.SGD(params, lr=0.1), params, period=4,
                 compression=GlobalQSGD(bits=8))

Importing this package imports neither torch, TensorFlow nor any ``horovod.<framework>``
module; the adapter for a framework loads when the first tensor of that framework arrives.
"""

from .compressor import GlobalQSGD
from .core import levels, min_bits
from .qsgd import QSGDAllgather

__all__ = ["GlobalQSGD", "QSGDAllgather", "levels", "min_bits"]
__version__ = "0.2.0"
