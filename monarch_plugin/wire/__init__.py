"""What crosses between the controller and its replicas: one vocabulary (`protocol`: store keys, generation plans,
reports), the checks both sides make of each other (`handshake`) and the signatures that make a value in the shared
store the run's own (`signing`). Both sides import these; they import nothing of either side.
"""
