"""Corpora: scripts that fetch and verify the text the examples train on."""
