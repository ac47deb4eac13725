"""Bridges from other trainers to mxmoe's expert products. Each module here imports its trainer;
``import mxmoe`` imports none of them (they are optional dependencies: ``pip install 'mxmoe[torchtitan]'``).

==============  =====================================================================================
``torchtitan``  a torchtitan (0.2.2) model converter: its MoE experts on mxmoe's recipes
==============  =====================================================================================
"""
