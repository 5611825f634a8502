"""Held-out evaluation and its statistics, apart from training (a layer above `sprout.rl`).

    evaluate.py    a policy on prompts with gold answers: pass@k, greedy accuracy, format rate,
                   per level and per problem, the same figures on any number of processes
    tasks.py       the held-out problems of each task (arithmetic, GSM8K, a prompt file)
    statistics.py  95 % intervals: Wilson, bootstrap, paired difference between two stages
"""
