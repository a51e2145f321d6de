"""What a run says: the Report, its longer notes, exceptions diagnosed into located issues, and
the progress of long work.
"""
