"""Datasets for the course: where MNIST-format data comes from, how it is checked, how it is held in memory."""
