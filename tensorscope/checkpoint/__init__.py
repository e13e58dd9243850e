"""Optimal activation checkpointing (rotor) under a memory limit."""
