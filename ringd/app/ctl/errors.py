"""What goes wrong in ringctl, said so that the user can act: every module of ctl/ raises it,
``main`` prints it and exits 1."""


class CtlError(Exception):
    pass
