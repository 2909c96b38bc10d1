# Copyright (c) 2024, NVIDIA CORPORATION. All rights reserved.
# asynctron: emptied; the original imports the trainer (and triton). The data tests and tools
# import only its submodules.
