"""Held-out evaluation and its statistics, apart from training.

    evaluate.py    a policy on prompts with gold answers: pass@k, greedy accuracy, format rate
    tasks.py       the held-out problems of each task (arithmetic, GSM8K, a prompt file)
    statistics.py  95 % intervals: Wilson, bootstrap, paired difference between two stages
"""
