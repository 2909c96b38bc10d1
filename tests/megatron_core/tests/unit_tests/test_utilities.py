# Copyright (c) 2026 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
# asynctron: trimmed to `Utils.rank`, `Utils.world_size` and `Utils.initialize_distributed`, which
# is all the data tests use. The original initializes NCCL on a GPU per rank; here one gloo rank
# on the CPU (a file rendezvous, so no port is taken), which the data tests run on unchanged.
import os
import tempfile

import torch


class Utils:

    world_size = int(os.environ.get('WORLD_SIZE', '1'))
    rank = int(os.environ.get('LOCAL_RANK', '0'))
    inited = False

    @staticmethod
    def initialize_distributed():
        if not torch.distributed.is_initialized() and Utils.rank >= 0:
            rendezvous = tempfile.NamedTemporaryFile(prefix="megatron-tests-rdzv-", delete=False)
            rendezvous.close()
            os.unlink(rendezvous.name)
            torch.distributed.init_process_group(
                backend='gloo',
                init_method=f'file://{rendezvous.name}',
                world_size=Utils.world_size,
                rank=Utils.rank,
            )
            torch.distributed.barrier()
        Utils.inited = True
