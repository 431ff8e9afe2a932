"""Plumbing the lessons share: the command line, launchers, models, evaluation and outputs.

The distributed idea each lesson teaches stays inline in that lesson; only what repeats unchanged lives here.
"""
