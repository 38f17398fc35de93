"""T(k) of a real int8 target on each int8 kernel the self-check passes on this CPU (specdec/models/
int8_kernels.py), alternated in one process. Usage: python int8_kernels.py MODEL_DIR 1,2,3,5,8,17"""
import datetime
import json
import sys

import torch

from specdec.bench.forward import prefilled_cache, time_block
from specdec.bench.suite import machine_description
from specdec.models import int8_kernels, quantize
from specdec.models.loading import load

model = load(sys.argv[1], quantize="int8")
layers = [m for m in model.network.modules() if isinstance(m, quantize.Int8Linear)]
print(quantize.kernel_notice(), flush=True)
# The int8 weights are recovered from the chosen kernel's layout once, then stored in each candidate's.
plain = {}
for layer in layers:
    identity = torch.eye(layer.in_features) * layer.kernel.activation_max
    product = layer.kernel.matmul(identity, layer.weight_int8)  # [in, out] = amax * W^T
    plain[layer] = (product / layer.kernel.activation_max).round().t().to(torch.int8).contiguous()
shapes = {(layer.out_features, layer.in_features) for layer in layers}
usable = [kernel for kernel in int8_kernels.CANDIDATES
          if all(int8_kernels.check_kernel(kernel, *shape) is None for shape in shapes)]
stored = {kernel.name: [kernel.prepare(plain[layer]) for layer in layers] for kernel in usable}


def use(kernel):
    for layer, weight in zip(layers, stored[kernel.name], strict=True):
        layer.kernel, layer.weight_int8 = kernel, weight


cache = prefilled_cache(model, 1, 64)
blocks = [int(b) for b in sys.argv[2].split(",")]
result = {kernel.name: {} for kernel in usable}
for k in blocks:
    for kernel in usable:
        use(kernel)
        time_block(model, cache, k, 1)
        result[kernel.name][k] = time_block(model, cache, k, 5) * 1e3
    print(k, {name: round(v[k], 1) for name, v in result.items()}, flush=True)
print(json.dumps({"date": datetime.datetime.now().isoformat(), "machine": machine_description(),
                  "refused": [k.name for k in int8_kernels.CANDIDATES if k not in usable], "ms": result}))
