"""Op graphs: the IR (ir.py), the tracer (trace.py), the PipeDream loader, features."""
