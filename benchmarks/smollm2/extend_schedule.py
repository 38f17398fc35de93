"""Change a distillation checkpoint's planned number of steps (how the SmolLM2 draft's schedule
was extended to 800 steps at step 250, then cut to 600 at step 600; see its model card):
    python extend_schedule.py CHECKPOINT.pt STEPS
then `specdec train ... --draft-steps STEPS --resume` continues on the cosine schedule of STEPS."""
import sys

import torch

p=sys.argv[1]
s=torch.load(p, weights_only=False, map_location='cpu')
print("step", s['step'], "old total", s['history']['total_steps'])
s['history']['total_steps']=int(sys.argv[2]); s['plan']['minutes']=None; s['plan']['steps']=int(sys.argv[2])
torch.save(s, p); print("new total", sys.argv[2])
