"""T(k) of a real int8 target, `torch._int_mm` vs the prepacked oneDNN kernel, alternated in one
process. Usage: python int8_kernels.py MODEL_DIR 1,2,3,5,8,17"""
import json, sys, datetime, torch
from specdec.models import quantize as q
q.PACKED_KERNEL_AVAILABLE = False
from specdec.models.loading import load
from specdec.bench.forward import prefilled_cache, time_block
from specdec.bench.suite import machine_description
model = load(sys.argv[1], quantize="int8")
layers = [m for m in model.network.modules() if isinstance(m, q.Int8Linear)]
plain = [m.weight_int8 for m in layers]
packed = [q.pack_weight(w) for w in plain]
def use(kind):
    for m, a, b in zip(layers, plain, packed):
        m.weight_int8, m.packed = (b, True) if kind == "packed" else (a, False)
cache = prefilled_cache(model, 1, 64)
blocks = [int(b) for b in sys.argv[2].split(",")]
res = {"_int_mm": {}, "packed": {}}
for k in blocks:
    for kind in res:
        use(kind); time_block(model, cache, k, 1)
        res[kind][k] = time_block(model, cache, k, 5) * 1e3
    print(k, {kind: round(v[k], 1) for kind, v in res.items()}, flush=True)
print(json.dumps({"date": datetime.datetime.now().isoformat(), "machine": machine_description(), "ms": res}))
