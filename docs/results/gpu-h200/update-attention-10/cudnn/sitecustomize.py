"""Experiment: NO_CUDNN_SDP=1 turns cuDNN's attention off in every process but a generator's."""

import os

if os.environ.get("NO_CUDNN_SDP") and not os.environ.get("CRUCIBLE_GENERATOR_PORT"):
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
