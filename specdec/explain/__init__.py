"""`specdec explain`: speculative decoding made visible, for people learning how it works.

calculator: Leviathan et al.'s expected tokens per step and speedup for each gamma.
record: one generation with every step's q, p, uniform draws and decision recorded.
lossless: a recorded step's verification re-run with many seeds, its histogram against p.
view / report: the terminal (rich) and the self-contained HTML views.
"""
