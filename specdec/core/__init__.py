"""The core, a room of its own: what speculative decoding is, on token ids, with no model format,
server or command in sight. engine (requests and batched steps), request, verify and verify_batch
(the verifiers: pure functions on tensors), rules and acceptance (how a sampled request draws and
judges drafts), sampling (one SamplingParams), policy and estimates (how much to draft, one cost
model per engine), metrics (what a generation measured), drafts (the drafter protocol: what
a drafter hands the engine, and hears back)."""
