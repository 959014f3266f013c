"""The vocabulary shared by every part of pdserve, standard library only: sampling parameters, the
events and loads that cross process boundaries, errors, roles and modes, block hashes, environment
names. Importing it loads no torch, Ray or engine, so the front doors and the SDK stay light."""
