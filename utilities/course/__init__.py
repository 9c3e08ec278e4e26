"""The course machinery: the ``fsdp-course`` command, the lesson catalog and harness, results,
the videos index, demo recording and the environment report. Lessons use it; users' training code
does not need it."""
