// A fixture: a file of the program.
#pragma once
