"""Recorders: context managers that collect the events of what runs inside them.

A subclass gets its own list of active recorders; code that has something to report calls
``record`` on the class, and every recorder of that class open now (nested ones too) keeps it:

    class RingLog(Recorder): ...
    with RingLog() as log:
        ring_attention(q, k, v, group)      # calls RingLog.record({...}) for each block
    log.events
"""


class Recorder:
    """Context manager: ``events`` holds what was recorded while it was open."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._active = []

    def __init__(self):
        self.events = []

    def __enter__(self):
        type(self)._active.append(self)
        return self

    def __exit__(self, *exc):
        type(self)._active.remove(self)
        return False

    @classmethod
    def recording(cls):
        """True while a recorder of this class is open (skip building an event otherwise)."""
        return bool(cls._active)

    @classmethod
    def record(cls, event):
        for recorder in cls._active:
            recorder.events.append(event)
