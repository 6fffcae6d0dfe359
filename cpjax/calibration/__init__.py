"""Calibration: training losses, their differentiable surrogates, metrics, temperature
scaling, bootstrap intervals and the end-of-run report. Pure math but the report writer."""
