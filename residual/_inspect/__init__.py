"""What users look at: `residual.inspect` and `residual.peak`.

    analysis.py  inspect(): a function's residuals, each policy's decision, compiled memory
    report.py    Report, the table inspect returns (text, HTML, dicts, data frame, plot)
    peak.py      peak(): what is live at a compiled program's peak, and Peak, its report
    buffers.py   a compiled module's buffers and live ranges, read from XLA's dumps

To add a column to inspect's table: `report.Report` and `analysis._row`; to add a kind
of buffer to the peak: `peak.KINDS` and `peak._kind`.
"""
