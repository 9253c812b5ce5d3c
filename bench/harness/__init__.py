"""Processes and scenarios shared by the benches and the tests (which import them from here).

The tests run the bounded versions of the scenarios; the benches run them longer and measure.
"""
