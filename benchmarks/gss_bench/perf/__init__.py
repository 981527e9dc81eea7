"""Speed and memory of gss: inference overhead, calibration cost, solve scaling, peak memory."""
