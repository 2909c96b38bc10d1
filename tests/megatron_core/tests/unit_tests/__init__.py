import torch._dynamo

torch._dynamo.config.suppress_errors = True
