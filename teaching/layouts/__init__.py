"""Layouts, smem plans and bank analysis of the teaching kernels, built from ``cute_kda.layouts``' atoms."""
